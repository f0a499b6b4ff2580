// Named profiles of a pipeline with several denoisers. See ddo/core/pipeline_profiles.h.
#include "ddo/core/pipeline_profiles.h"

#include <algorithm>
#include <cctype>

namespace ddo::core {

bool is_denoiser_component(std::string_view component) {
  for (std::string_view stem : kDenoiserComponentStems) {
    if (component.substr(0, stem.size()) != stem) continue;
    const std::string_view rest = component.substr(stem.size());
    if (rest.empty()) return true;
    if (rest.size() < 2 || rest[0] != '_') continue;
    const bool digits = std::all_of(rest.begin() + 1, rest.end(), [](char c) {
      return std::isdigit(static_cast<unsigned char>(c));
    });
    if (digits) return true;
  }
  return false;
}

std::string denoiser_profile_name(std::string_view profile_name, std::string_view component,
                                  std::size_t index) {
  if (profile_name.empty()) return {};
  std::string name(profile_name);
  if (index == 0) return name;
  name += kDenoiserProfileSeparator;
  name += component;
  return name;
}

std::vector<double> budget_shares(const std::vector<std::int64_t>& weights_bytes) {
  std::vector<double> shares(weights_bytes.size(), 0.0);
  if (weights_bytes.empty()) return shares;
  double total = 0.0;
  for (std::int64_t w : weights_bytes) total += static_cast<double>(std::max<std::int64_t>(w, 0));
  for (std::size_t i = 0; i < shares.size(); ++i) {
    shares[i] = total > 0 ? static_cast<double>(std::max<std::int64_t>(weights_bytes[i], 0)) / total
                          : 1.0 / static_cast<double>(shares.size());
  }
  // Rounding may put the sum a unit in the last place above 1; the largest share gives it back,
  // so the saved recommendations never sum above the measured room.
  double sum = 0.0;
  for (double s : shares) sum += s;
  if (sum > 1.0) {
    auto largest = std::max_element(shares.begin(), shares.end());
    *largest = std::max(0.0, *largest - (sum - 1.0));
  }
  return shares;
}

}  // namespace ddo::core
