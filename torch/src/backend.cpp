// The registry of backend records (backend.h).
#include "backend.h"

#include <algorithm>
#include <array>
#include <mutex>

namespace ddo::adapter::internal {
namespace {

// The records, constant-initialized: the compiled-in ones first, then those tests add. Eight is
// far above the kinds there are; a ninth registration is refused.
struct Registry {
  std::mutex mu;
  std::array<const Backend*, 8> records{&kSimBackend, &kCudaBackend};  // LOCK: mu
  std::size_t count = 2;                                               // LOCK: mu
};

Registry g_registry;

// The kind part of a device name: "cuda" of "cuda:1".
std::string_view kind_of(std::string_view device_name) {
  return device_name.substr(0, device_name.find(':'));
}

// "\"sim:N\" or \"cuda:N\"", for errors.
std::string known_names(const Registry& r) {
  std::string out;
  for (std::size_t i = 0; i < r.count; ++i) {
    if (i > 0) out += i + 1 == r.count ? " or " : ", ";
    out += ddo::internal::str_cat("\"", r.records[i]->name, ":N\"");
  }
  return out;
}

}  // namespace

std::string Backend::device_name(int index) const {
  return ddo::internal::str_cat(name, ":", index);
}

std::vector<const Backend*> backends() {
  std::lock_guard<std::mutex> lock(g_registry.mu);
  return {g_registry.records.begin(), g_registry.records.begin() + g_registry.count};
}

const Backend& backend_for(engine::DeviceKind kind) {
  std::lock_guard<std::mutex> lock(g_registry.mu);
  for (std::size_t i = 0; i < g_registry.count; ++i) {
    if (g_registry.records[i]->kind == kind) return *g_registry.records[i];
  }
  throw Error(Code::kInternal, ddo::internal::str_cat("no backend record for engine device kind ",
                                                      static_cast<int>(kind),
                                                      "; records: ", known_names(g_registry)));
}

const Backend* find_backend(c10::DispatchKey key) {
  std::lock_guard<std::mutex> lock(g_registry.mu);
  for (std::size_t i = 0; i < g_registry.count; ++i) {
    if (g_registry.records[i]->dispatch_key == key) return g_registry.records[i];
  }
  return nullptr;
}

const Backend& backend_named(std::string_view device_name) {
  const std::string_view kind = kind_of(device_name);
  if (kind == "cpu") return kSimBackend;
  std::lock_guard<std::mutex> lock(g_registry.mu);
  for (std::size_t i = 0; i < g_registry.count; ++i) {
    if (kind == g_registry.records[i]->name) return *g_registry.records[i];
  }
  throw Error(Code::kInvalidArgument,
              ddo::internal::str_cat("device \"", device_name,
                                     "\" is not a kind this build of ddo executes on; use ",
                                     known_names(g_registry)));
}

BackendRegistration::BackendRegistration(const Backend& backend) : backend_(&backend) {
  std::lock_guard<std::mutex> lock(g_registry.mu);
  Registry& r = g_registry;
  for (std::size_t i = 0; i < r.count; ++i) {
    const Backend& b = *r.records[i];
    DDO_CHECK(b.kind != backend.kind && std::string_view(b.name) != backend.name &&
                  b.dispatch_key != backend.dispatch_key,
              Code::kInvalidArgument, "backend \"", backend.name,
              "\" shares its engine kind, name or dispatch key with \"", b.name,
              "\"; a registered backend needs all three of its own");
  }
  DDO_CHECK(backend.name != std::string_view("cpu"), Code::kInvalidArgument,
            "backend name \"cpu\" is plan mode's host; choose another name");
  DDO_CHECK(r.count < r.records.size(), Code::kInvalidArgument, "backend \"", backend.name,
            "\" would be record ", r.count + 1, "; the registry holds ", r.records.size());
  r.records[r.count++] = &backend;
}

BackendRegistration::~BackendRegistration() {
  std::lock_guard<std::mutex> lock(g_registry.mu);
  Registry& r = g_registry;
  auto* end = r.records.begin() + r.count;
  auto* it = std::find(r.records.begin(), end, backend_);
  if (it == end) return;
  std::copy(it + 1, end, it);
  --r.count;
}

}  // namespace ddo::adapter::internal
