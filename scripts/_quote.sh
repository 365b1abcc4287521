# Shared by scripts/_serve_common.sh and scripts/_bench_common.sh (sourced, not run): quoting, argument parsing
# and the error line of every serve / bench script.
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

# script_parse_args VARIABLES_TEXT "$@": DRY_RUN (0 | 1) and EXTRA (the engine's arguments); --help prints the
# calling script's header and VARIABLES_TEXT, then exits 0.
script_parse_args() {
  local variables=$1 arg; shift
  DRY_RUN=0; EXTRA=()
  for arg in "$@"; do
    case $arg in
      --dry-run) DRY_RUN=1 ;;
      -h|--help) sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"; echo; echo "$variables"; exit 0 ;;
      --) ;;
      *) EXTRA+=("$arg") ;;
    esac
  done
}

script_fail() { echo "error: $*" >&2; return 2; }
