// append_observation: the one rule for adding a calibration observation to a stored record,
// shared by named profiles (ProfileStore::save) and host contexts (HostContextStore::record), so
// that both files keep the same history and move their capacity limits the same way (internal to
// ddo_core). Separate because neither store owns the rule: each only says what an observation is.
//
//   std::vector<nlohmann::json> history;
//   CapacityLimits limits;
//   internal::append_observation(observation, observation, &limits, &history);
//   // history ends with observation; at most kMaxProfileObservations are kept, oldest dropped
#pragma once

#include <cstddef>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "ddo/core/profile_store.h"

namespace ddo::core::internal {

// Moves `limits` by the library's generic rule over `written` (the observation as its file holds
// it: {"status", "capacity": {"metric", "value"}}; update_limits_from_observation), then appends
// `observation` to `history`, keeping the newest kMaxProfileObservations.
template <typename Observation>
void append_observation(const nlohmann::json& written, Observation observation,
                        CapacityLimits* limits, std::vector<Observation>* history) {
  update_limits_from_observation(*limits, written);
  history->push_back(std::move(observation));
  if (history->size() > kMaxProfileObservations) {
    history->erase(history->begin(),
                   history->end() - static_cast<std::ptrdiff_t>(kMaxProfileObservations));
  }
}

}  // namespace ddo::core::internal
