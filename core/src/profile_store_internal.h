// The two errors every part of the profile store returns in the same words (internal to
// ddo_core): a profile directory that cannot be written, and a file that cannot be trusted.
// Shared by the durable files (profile_files.cpp), the record schema (profile_schema.cpp) and
// the store (profile_store.cpp).
#pragma once

#include <filesystem>
#include <string>

#include "ddo/core/status.h"

namespace ddo::core::internal {

// kUnavailable: profiles cannot be written in `directory` (`what` says why); names DDO_PROFILE_DIR.
Status unavailable_dir(const std::filesystem::path& directory, const std::string& what);

// kDataLoss with `message`: a file that is read but cannot be used.
Status data_loss(std::string message);

}  // namespace ddo::core::internal
