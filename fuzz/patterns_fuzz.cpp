// Fuzz target: the module-pattern compiler (check_module_pattern, then the planner's compile),
// fed as users write patterns: a DDO_*_PATTERNS value split on ',' and ';'. A pattern either
// compiles or is refused with ddo::Error naming the field; a compiled one is searched in a few
// module names as the planner does.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "ddo/core/settings.h"
#include "ddo/core/status.h"
#include "fuzz_util.h"
#include "planner_internal.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace ddo::core;
  const std::string_view text = ddo::fuzz::as_text(data, size);
  const std::vector<std::string> patterns = split_pattern_list(text);
  for (std::size_t i = 0; i < patterns.size(); ++i) {
    const ddo::Status checked = check_module_pattern("skip_modules_pattern", i, patterns[i]);
    DDO_FUZZ_EXPECT(checked.ok() || !checked.message().empty());
  }
  planner_internal::CompiledPatterns compiled;
  try {
    compiled = planner_internal::compile(patterns, "skip_modules_pattern");
  } catch (const ddo::Error& e) {
    DDO_FUZZ_EXPECT(e.status().message().find("skip_modules_pattern") != std::string::npos);
    return 0;
  }
  static const std::string kNames[] = {"transformer_blocks.0.attn.to_q",
                                       "single_transformer_blocks.37.proj_out",
                                       "vae.decoder",
                                       "text_encoder.encoder.layer.11.ff",
                                       "0",
                                       ""};
  for (const std::string& name : kNames) (void)compiled.search(name);
  return 0;
}
