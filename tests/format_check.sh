#!/usr/bin/env bash
# The C++ sources follow .clang-format (Google style): any drift fails.
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t files < <(git ls-files '*.cc' '*.h' 2>/dev/null || find ptc transfer fs tools tests -name '*.cc' -o -name '*.h')
clang-format --dry-run --Werror "${files[@]}"
echo "clang-format: ${#files[@]} files clean"
