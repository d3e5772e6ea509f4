# Sourced by benchmarks/gpu.sh and gpu_train.sh: their arguments, and their steps run one after another, each one's
# JSON records gathered into one list as soon as it finishes, so that a run cut short (a device call's time limit)
# still leaves every finished step's numbers. A step that fails (a model it cannot load, a package missing) leaves a
# record saying why, {"step": NAME, "skipped": "<its last line on stderr>"}, and the script goes on with the next.
#
# Arguments: [--dry-run] [--carry DIR | DATA_DIR]. --carry: a folder scripts/gpu_carry.py prepared (its data folder
# and bert-base-uncased's vocabulary for random:<shape>, in place of the packaged MiniLM); else DATA_DIR, default
# $SBERT_RAY_DATA_DIR, else ../shared/data. The list is rewritten after each step to $OUT/<script>.json when OUT is
# set (a device call's output folder), and printed on stdout at the end.

dry_run=false carry=
while (($#)); do
  case $1 in
    --dry-run) dry_run=true; shift ;;
    --carry) carry=${2:?--carry needs a folder}; shift 2 ;;
    *) break ;;
  esac
done
if [[ -n $carry ]]; then
  data_dir=$carry/data
  SBERT_RAY_BERT_VOCAB=$(realpath "$carry/tokenizer/vocab.txt") || exit 2
  export SBERT_RAY_BERT_VOCAB
else
  data_dir=${1:-${SBERT_RAY_DATA_DIR:-../shared/data}}
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's sbert_ray, for torchrun's script too
out_dir=$(mktemp -d)
trap 'rm -rf "$out_dir"' EXIT
results=${OUT:+$OUT/$(basename "$0" .sh).json}
results=${results:-$out_dir/results.json}
steps_run=0 steps_ok=0

# step NAME COMMAND...: runs `COMMAND --output FILE` (its progress on stderr), which writes its JSON records (a list,
# or one record) to FILE.
step() {
  local name=$1 json log rc
  shift
  json=$out_dir/$(printf %02d "$steps_run")-$name.json log=$out_dir/$name.log
  echo "== $name" >&2
  { "$@" --output "$json" 2>&1 >&3 3>&- | tee "$log" >&2 3>&-; } 3>&2  # stdout to stderr; stderr also to the log
  rc=${PIPESTATUS[0]}
  if ((rc == 0)) && [[ -s $json ]]; then
    steps_ok=$((steps_ok + 1))
  else
    python3 - "$name" "$rc" "$log" "$json" <<'PY'
import json, sys
name, rc, log, out = sys.argv[1:]
lines = [line.strip() for line in open(log, errors="replace") if line.strip()]
reason = lines[-1] if lines else "it failed without a message"
json.dump({"step": name, "skipped": reason, "exit_status": int(rc)}, open(out, "w"))
PY
  fi
  steps_run=$((steps_run + 1))
  gather > "$results.partial" && mv "$results.partial" "$results"
}

gather() {
  python3 - "$out_dir"/[0-9]*.json <<'PY'
import json, os, sys
records = []
for path in sys.argv[1:]:
    loaded = json.load(open(path))
    name = os.path.basename(path)[3:-5]  # NN-<step>.json
    records += [{"step": name, **record} for record in (loaded if isinstance(loaded, list) else [loaded])]
print(json.dumps(records, indent=2))
PY
}

# finish: the gathered list on stdout; fails only when no step ran to the end.
finish() {
  cat "$results"
  echo "$(basename "$0"): $steps_ok of $steps_run steps ran${OUT:+; records in $results}" >&2
  ((steps_ok > 0))
}
