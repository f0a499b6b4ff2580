/// \file
/// Named profiles of a pipeline with several denoisers (Wan 2.2 runs `transformer` for the
/// high-noise steps and `transformer_2`, the same class, for the low-noise ones): which
/// components are denoisers, the profile name each one gets, and how the room one calibration
/// region measured is shared between them. No torch: the pipeline router
/// (ddo/torch/pipeline_offload.h) and the pipeline's profile_run() call these.
///
/// ```
/// ddo::core::is_denoiser_component("transformer_2");   // true
/// ddo::core::is_denoiser_component("text_encoder_2");  // false
/// ddo::core::denoiser_profile_name("wan-5s", "transformer", 0);    // "wan-5s"
/// ddo::core::denoiser_profile_name("wan-5s", "transformer_2", 1);  // "wan-5s.transformer_2"
/// ddo::core::budget_shares({6 * kGiBBytes, 2 * kGiBBytes});        // {0.75, 0.25}
/// ```
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace ddo::core {

/// The names diffusers gives a pipeline's denoisers, without a trailing "_<digits>":
/// FLUX, SD3, Wan "transformer"; SD/SDXL, Kandinsky "unet"; Wuerstchen, Stable Cascade, Shap-E
/// "prior".
inline constexpr std::string_view kDenoiserComponentStems[] = {"transformer", "unet", "prior"};

/// Between a pipeline's profile name and a further denoiser's component name in the profile name
/// that denoiser gets ("wan-5s.transformer_2"). Profile names accept any text that is not only
/// whitespace (prepare_profile), and a name is stored verbatim.
inline constexpr std::string_view kDenoiserProfileSeparator = ".";

/// True when `component` names a denoiser: one of kDenoiserComponentStems, alone or followed by
/// '_' and digits ("transformer", "transformer_2", "unet"; not "prior_text_encoder", whose
/// stem is followed by a word, nor "text_encoder").
bool is_denoiser_component(std::string_view component);

/// The profile name of the pipeline's `index`-th profiled denoiser (0-based, in the pipeline's
/// order): the first keeps `profile_name` itself, so a profile saved for a one-denoiser pipeline
/// or a single model still applies; each further one gets
/// `profile_name` + kDenoiserProfileSeparator + `component`. "" when `profile_name` is "".
std::string denoiser_profile_name(std::string_view profile_name, std::string_view component,
                                  std::size_t index);

// Note [Denoisers share one calibration]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A pipeline attaches all its denoisers at once and they stay attached for the whole generation,
// so their resident modules are on the card together: Wan 2.2's transformer keeps its residents
// while transformer_2 runs, and the other way round. One calibration region covers the
// generation (every denoiser at a zero resident budget) and measures one peak, so one room:
// total - peak - headroom. Saving that room whole as each denoiser's recommendation would put N
// times the room on the card on the next run. It is split instead, in proportion to each
// denoiser's resident-candidate bytes (core::Plan::resident_candidate_bytes: what a resident
// budget can be spent on): a denoiser with three times the candidate bytes gains three times as
// much from the room, and two equal transformers get half each. A denoiser without candidates
// gets nothing, and when none has any the room is split evenly. The shares sum to at most 1, so
// the saved recommendations sum to at most the measured room.
//
// The split applies to what a region saves (finish_region: a calibration's budget, its SDNQ
// probe and safe budgets; a probe's overshoot is taken from each denoiser by its share). A
// reused recommendation is each denoiser's own saved share, under its own profile name
// (denoiser_profile_name), so no split happens at reuse. A single model's share is 1.

/// Each weight's share of a room, in proportion to `weights_bytes` (negative counts as 0); equal
/// shares when no weight is positive; {} for {}. The shares sum to at most 1. See Note [Denoisers
/// share one calibration].
std::vector<double> budget_shares(const std::vector<std::int64_t>& weights_bytes);

}  // namespace ddo::core
