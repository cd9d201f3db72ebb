#include "tools/model_options.h"

#include "absl/strings/str_cat.h"
#include "ptc/model_spec.h"
#include "ptc/status_macros.h"

namespace scalai {

void ModelOptions::Register(CLI::App* app, bool required) {
  app->add_option("--layout", layout,
                  "layout preset (megatron-core-gpt, hf-llama) or JSON file")
      ->required(required);
  app->add_option("--param", params, "layout parameter k=v (repeatable)");
  app->add_option("--model", model,
                  "model sizes: layers=,hidden=,heads=,vocab= "
                  "[groups=,ffn=,bias=,optimizer=adam,"
                  "<layout param>=]")
      ->required(required);
  app->add_option("--dtype", dtype, "parameter dtype (bf16, f16, f32, ...)")
      ->capture_default_str();
}

absl::StatusOr<LoadedModel> ModelOptions::Load() const {
  ASSIGN_OR_RETURN(Layout loaded_layout, Layout::Load(layout));
  for (const std::string& kv : params) {
    size_t eq = kv.find('=');
    if (eq == std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("--param \"", kv, "\": expected k=v"));
    }
    RETURN_IF_ERROR(
        loaded_layout.SetParam(kv.substr(0, eq), kv.substr(eq + 1)));
  }
  ASSIGN_OR_RETURN(ModelSpec spec, ModelSpec::Parse(model));
  RETURN_IF_ERROR(spec.ApplyParams(loaded_layout));
  ASSIGN_OR_RETURN(DType parsed_dtype, ParseDType(dtype));
  ASSIGN_OR_RETURN(Model built, spec.Build(loaded_layout, parsed_dtype));
  return LoadedModel{std::move(loaded_layout),
                     std::make_shared<const Model>(std::move(built))};
}

}  // namespace scalai
