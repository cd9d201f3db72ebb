// `scalai init`: creates an empty store for a model with a layout.
#include <cstdio>
#include <memory>
#include <optional>

#include "absl/strings/str_cat.h"
#include "ptc/status_macros.h"
#include "tools/command.h"
#include "tools/model_options.h"
#include "transfer/store.h"

namespace scalai {
namespace {

struct InitOptions {
  std::string store;
  std::string layout;
  std::vector<std::string> params;
};

absl::Status RunInit(const InitOptions& o) {
  ASSIGN_OR_RETURN(Layout layout, Layout::Load(o.layout));
  for (const std::string& kv : o.params) {
    size_t eq = kv.find('=');
    if (eq == std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("--param \"", kv, "\": expected k=v"));
    }
    RETURN_IF_ERROR(layout.SetParam(kv.substr(0, eq), kv.substr(eq + 1)));
  }
  ASSIGN_OR_RETURN(auto store, Store::Create(o.store, layout));
  std::printf("initialized store %s (layout %s)\n", o.store.c_str(),
              layout.name().c_str());
  return absl::OkStatus();
}

}  // namespace

Command AddInitCommand(CLI::App& root) {
  auto o = std::make_shared<InitOptions>();
  CLI::App* app = root.add_subcommand(
      "init", "Create an empty store for a model with a layout");
  app->add_option("STORE", o->store, "store directory (created, mode 0700)")
      ->required();
  app->add_option("--layout", o->layout, "layout preset or JSON file")
      ->required();
  app->add_option("--param", o->params, "layout parameter k=v (repeatable)");
  return {app, [o] { return RunInit(*o); }};
}

}  // namespace scalai
