// sha256_hex (profile_store.h): the one hash of ddo_core, behind one function so that each
// platform uses its own system library and every caller gets the same digest.
//
// Note [SHA-256 per platform]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Profile file names are a SHA-256 of canonical JSON (Note [diffusers-dynamic-offloader's files]),
// so Linux and Windows must produce the same digest for the same text, byte for byte. Linux uses
// OpenSSL's EVP (libcrypto, which every Linux build already has); Windows uses CNG (bcrypt.dll,
// part of Windows since Vista, and of Wine), so the Windows build needs no OpenSSL for MinGW. Both
// are checked against the FIPS 180-2 vectors in profile_store_test.cpp (Sha256KnownVectors), which
// the Windows build runs under Wine.
#include "ddo/core/profile_store.h"

#include <cstdint>

#ifdef _WIN32
#include "win32.h"
// windows.h first: bcrypt.h needs its types.
#include <bcrypt.h>

#include <algorithm>
#include <limits>
#else
#include <openssl/evp.h>
#endif

namespace ddo::core {
namespace {

constexpr std::size_t kDigestBytes = 32;

std::string to_hex(const unsigned char* digest, std::size_t length) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(2 * length);
  for (std::size_t i = 0; i < length; ++i) {
    out.push_back(kHex[digest[i] >> 4]);
    out.push_back(kHex[digest[i] & 0xf]);
  }
  return out;
}

#ifdef _WIN32
// One provider handle for the process: CNG handles may be shared by threads, and opening one
// loads the provider each time.
BCRYPT_ALG_HANDLE sha256_provider() {
  static const BCRYPT_ALG_HANDLE provider = [] {
    BCRYPT_ALG_HANDLE handle = nullptr;
    const NTSTATUS status =
        BCryptOpenAlgorithmProvider(&handle, BCRYPT_SHA256_ALGORITHM, nullptr, 0);
    DDO_ASSERT(BCRYPT_SUCCESS(status), "BCryptOpenAlgorithmProvider(SHA256) failed: NTSTATUS ",
               static_cast<long>(status));
    return handle;
  }();
  return provider;
}
#endif

}  // namespace

std::string sha256_hex(std::string_view data) {
  unsigned char digest[kDigestBytes];
#ifdef _WIN32
  BCRYPT_HASH_HANDLE hash = nullptr;
  NTSTATUS status = BCryptCreateHash(sha256_provider(), &hash, nullptr, 0, nullptr, 0, 0);
  DDO_ASSERT(BCRYPT_SUCCESS(status), "BCryptCreateHash failed: NTSTATUS ",
             static_cast<long>(status));
  // BCryptHashData takes a ULONG length: feed larger inputs in pieces.
  constexpr std::size_t kChunk = std::numeric_limits<ULONG>::max();
  for (std::size_t at = 0; BCRYPT_SUCCESS(status) && at < data.size(); at += kChunk) {
    const std::size_t n = std::min(kChunk, data.size() - at);
    status = BCryptHashData(hash, reinterpret_cast<PUCHAR>(const_cast<char*>(data.data() + at)),
                            static_cast<ULONG>(n), 0);
  }
  if (BCRYPT_SUCCESS(status)) status = BCryptFinishHash(hash, digest, kDigestBytes, 0);
  BCryptDestroyHash(hash);
  DDO_ASSERT(BCRYPT_SUCCESS(status), "BCrypt SHA-256 failed: NTSTATUS ", static_cast<long>(status));
#else
  unsigned int length = 0;
  const int ok = EVP_Digest(data.data(), data.size(), digest, &length, EVP_sha256(), nullptr);
  DDO_ASSERT(ok == 1 && length == kDigestBytes, "EVP_Digest(sha256) failed");
#endif
  return to_hex(digest, kDigestBytes);
}

}  // namespace ddo::core
