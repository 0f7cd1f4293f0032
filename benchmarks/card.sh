# Sourced by the GPU scripts: time limits that fit the card the script runs on.
# Every limit in a script is written for one H200 (the card its figures were measured on) and passes
# through `scaled SECONDS`, which multiplies it by CARD_SCALE:
#   H200 1.0; H100 1.5 (3.35 against 4.8 TB/s of memory bandwidth, and a slower host seen here);
#   any other card 2.5. Set CARD_SCALE yourself to override (e.g. CARD_SCALE=3 on a busy machine).
# `card_name` is the first GPU's name, or "no GPU".
card_name() { nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || true; }
if [[ -z "${CARD_SCALE:-}" ]]; then
  case "$(card_name)" in
    *H200*) CARD_SCALE=1.0 ;;
    *H100*) CARD_SCALE=1.5 ;;
    *) CARD_SCALE=2.5 ;;
  esac
fi
export CARD_SCALE
scaled() { python3 -c "import sys; print(int(round(float(sys.argv[1]) * float(sys.argv[2]))))" "$1" "$CARD_SCALE"; }
echo "card: $(card_name) (limits x$CARD_SCALE of an H200's)"
