# Shared by scripts/_serve_common.sh and scripts/_bench_common.sh (sourced, not run).
# shell_line ARGS...: the arguments as one shell line that runs them (quoted only where the shell needs it),
# so a printed --dry-run line can be pasted, and parsed back with shlex.split.
shell_line() {
  local out=() arg
  for arg in "$@"; do
    if [[ $arg =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then out+=("$arg")
    elif [[ $arg != *"'"* ]]; then out+=("'$arg'")
    else out+=("$(printf '%q' "$arg")"); fi
  done
  echo "${out[*]}"
}
