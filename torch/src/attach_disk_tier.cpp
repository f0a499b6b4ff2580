// The disk tier's host storage (Note [Disk-tier storage]): the tensors of disk-tier units over
// the checkpoint file's copy-on-write mapping, or over a temporary file where the file's bytes
// are not what the parameter holds.
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <tuple>
#include <vector>

#include "ddo/core/mapped_file.h"
#include "attach_common.h"
#include "attach_placement.h"
#include "offload_state.h"
#include "weight_source.h"

namespace ddo::adapter::internal {

// Note [Disk-tier storage]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// A disk-tier unit's bytes stay in the checkpoint: the copy scheduler reads them every step into
// its pinned ring. Its parameters still need host storage that reads as the weight, for what ddo
// does not intercept (an op on `weight * 1.0`, state_dict, torch.save, printing). They point into
// the checkpoint file itself, mapped copy-on-write (core::MappedFile): its pages come from the
// page cache when something reads them and cost nothing until then, a write gets a private page
// and never reaches the file (Note [Weights changed in place] refuses to serve it). A tensor whose
// file bytes are not what its parameter holds (another dtype, LoadOptions::dtype) or that is not
// aligned to its element size is converted once at attach into a temporary file in the system's
// temporary directory, mapped the same way, its pages dropped once written (setup.load
// "disk_spill_bytes").
namespace {

struct DiskBacking {
  std::map<int, core::MappedFile> files;  // checkpoint file index -> its mapping
  core::MappedFile spill;
};

}  // namespace

std::shared_ptr<void> map_disk_tensors(OffloadState& s, const std::vector<UnitLayout>& units,
                                       DiskTensorData* data) {
  auto backing = std::make_shared<DiskBacking>();
  data->assign(units.size(), {});
  std::vector<std::tuple<std::size_t, std::size_t, std::size_t>> spilled;  // unit, k, offset
  std::vector<WeightSource::Read> spill_reads;
  std::size_t spill_bytes = 0;
  for (std::size_t ui = 0; ui < units.size(); ++ui) {
    const UnitLayout& u = units[ui];
    if (!u.disk) continue;
    (*data)[ui].assign(u.ids.size(), nullptr);
    for (std::size_t k = 0; k < u.ids.size(); ++k) {
      const ReplacedTensor& r = s.replaced[u.ids[k]];
      const core::CheckpointTensor& t = s.weights->find(r.name);
      const auto element = static_cast<std::uint64_t>(r.handle.element_size());
      if (to_scalar_type(t.dtype) == r.handle.scalar_type() && t.offset % element == 0) {
        auto [it, fresh] = backing->files.try_emplace(t.file);
        if (fresh) {
          throw_if_error(
              core::MappedFile::map_private(s.weights->checkpoint().files[t.file], &it->second));
        }
        (*data)[ui][k] = it->second.data() + t.offset;
        continue;
      }
      spill_bytes = (spill_bytes + 255) / 256 * 256;
      spilled.emplace_back(ui, k, spill_bytes);
      spill_reads.push_back(
          {r.name, reinterpret_cast<void*>(spill_bytes), r.handle.scalar_type(), r.handle.numel()});
      spill_bytes += span_bytes(r.handle);
    }
  }
  if (spill_bytes > 0) {
    std::filesystem::path tmp;
    throw_if_error(core::MappedFile::temporary_directory(&tmp));
    throw_if_error(core::MappedFile::create_temporary(tmp, spill_bytes, &backing->spill));
    throw_if_error(s.weights->read_unit(spill_reads, backing->spill.data()));
    backing->spill.drop_pages(0, spill_bytes);
    for (const auto& [ui, k, offset] : spilled) (*data)[ui][k] = backing->spill.data() + offset;
    s.setup.disk_spill_bytes = static_cast<std::int64_t>(spill_bytes);
  }
  return backing;
}

}  // namespace ddo::adapter::internal
