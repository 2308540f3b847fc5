# Sourced by scripts/test.sh and scripts/serve.sh after set-up: takes a leading
# `--device NAME` off the arguments and puts that device in place.
#   --device cpu            the host emulation (VLLM_BR_DEVICE=cpu, the default
#                           of test.sh)
#   --device supa           a Biren card through torch_br
#   --device supa-standin   the stand-in SUPA device of tests/standin/ (a real
#                           PyTorch device `supa` backed by host memory, with
#                           pybrml and libsuccl.so stand-ins): the supa
#                           backend runs as on a card, without one
# Sets DEVICE_ARGS to the remaining arguments.
DEVICE_ARGS=("$@")
if [ "${1:-}" = "--device" ]; then
  [ $# -ge 2 ] || { echo "--device needs a value: cpu, supa or supa-standin" >&2; exit 2; }
  case "$2" in
    cpu|supa) export VLLM_BR_DEVICE="$2" ;;
    supa-standin) eval "$(.venv/bin/python tests/standin/build.py --env)" ;;
    *) echo "--device $2 is not a device; use cpu, supa or supa-standin" >&2; exit 2 ;;
  esac
  DEVICE_ARGS=("${@:3}")
fi
