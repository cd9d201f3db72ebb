// A subcommand of `scalai`: it registers its flags on the command line and
// runs after parsing. Each lives in its own <name>_command.cc.
//
//   Command plan = AddPlanCommand(root);
//   ... root.parse(argc, argv) ...
//   if (plan.app->parsed()) status = plan.run();
#ifndef SCALAI_TOOLS_COMMAND_H_
#define SCALAI_TOOLS_COMMAND_H_

#include <cstdint>
#include <functional>
#include <optional>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"

namespace scalai {

// The value of an optional flag such as --step, or nullopt when not given.
inline std::optional<int64_t> OptionalValue(const CLI::Option* option,
                                            int64_t value) {
  if (option->count() == 0) return std::nullopt;
  return value;
}

struct Command {
  CLI::App* app = nullptr;
  std::function<absl::Status()> run;
};

Command AddClusterCommand(CLI::App& root);
Command AddDatasetCommand(CLI::App& root);
Command AddExportCommand(CLI::App& root);
Command AddFsckCommand(CLI::App& root);
Command AddGpuBenchCommand(CLI::App& root);
Command AddImportCommand(CLI::App& root);
Command AddInitCommand(CLI::App& root);
Command AddInspectCommand(CLI::App& root);
Command AddMountCommand(CLI::App& root);
Command AddPlanCommand(CLI::App& root);
Command AddReconfigureCommand(CLI::App& root);
Command AddSynthCommand(CLI::App& root);
Command AddUmountCommand(CLI::App& root);

}  // namespace scalai

#endif  // SCALAI_TOOLS_COMMAND_H_
