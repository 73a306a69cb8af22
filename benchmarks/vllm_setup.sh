#!/bin/bash
# On the H200: join the carried vLLM parts (benchmarks/vllm_download.sh made them) and install them
# under /tmp/vsite, without dependencies; pitstop's own process never sees that folder: the bench
# gives it to vLLM's process only (PITSTOP_VLLM_PYTHONPATH=/tmp/vsite).
# The parts travel in .vv/ (one 50 MB part and the tracked tree fit a run's 64 MiB), one run after another:
# each run copies what it carries to /tmp/vv, which lasts while the machine stays up.
# Usage: bash benchmarks/vllm_setup.sh [PARTS_DIR=.vv]
# Exit status: 0 vLLM imports from /tmp/vsite; 2 parts still missing (carry the next); 1 failed.
set -u
src=${1:-.vv}
# wheels found missing after a set of parts was made travel beside them in .vx/ (EXTRA_DIR),
# installed into the same folder; a run may carry them at any time, before or after the parts
extra=${EXTRA_DIR:-.vx}
add_extra() {
  [ -d "$extra" ] && ls "$extra"/*.whl >/dev/null 2>&1 || return 0
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$extra"/*.whl 2>&1 \
    | grep -v "^WARNING: Target directory" | tail -3
  echo "vllm-setup: added $(ls "$extra"/*.whl | wc -l) extra wheel(s) from $extra"
}
vv=${VV_DIR:-/tmp/vv}
site=${VSITE:-/tmp/vsite}
if [ -f "$site/.done" ]; then add_extra; echo "vllm-setup: $(cat "$site/.done") in $site"; exit 0; fi
mkdir -p "$vv"
[ -d "$src" ] && cp -n "$src"/vp* "$vv"/ 2>/dev/null
want=${VV_PARTS:-$(cut -d' ' -f1 "$vv/vp.sum" 2>/dev/null)}
have=$(ls "$vv"/vp[0-9]* 2>/dev/null | wc -l)
if [ -z "$want" ] || [ "$have" -lt "$want" ]; then
  echo "vllm-setup: $have of ${want:-? (vp.sum not carried yet)} parts in $vv ($(ls "$vv" | tr '\n' ' ')); carry the next part(s) in .vv/ and run again"
  exit 2
fi
tar=/tmp/vall.tar
cat "$vv"/vp[0-9]* >"$tar"
if [ -f "$vv/vp.sum" ] && [ "$(md5sum <"$tar" | cut -d' ' -f1)" != "$(cut -d' ' -f2 "$vv/vp.sum")" ]; then
  echo "vllm-setup: the joined parts do not match vp.sum (a part is corrupt or from another download); remove $vv and carry them again"
  rm -f "$tar"; exit 1
fi
rm -rf /tmp/vx && mkdir -p /tmp/vx && tar xf "$tar" -C /tmp/vx && rm -f "$tar"
echo "vllm-setup: installing $(ls /tmp/vx/*.whl /tmp/vx/small/*.whl | wc -l) wheels under $site"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" /tmp/vx/*.whl /tmp/vx/small/*.whl 2>&1 | grep -v "^WARNING: Target directory" | tail -5
# pitstop's own process drives vllm serve over HTTP (httpx): give it the carried client only if
# the image lacks one, in a folder of its own (vLLM's site would shadow pitstop's packages)
if ! python3 -c "import httpx" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/vhttp /tmp/vx/small/{httpx,httpcore,h11,anyio,sniffio,certifi,idna}-*.whl
  echo "vllm-setup: httpx for pitstop's process in /tmp/vhttp (add it to PYTHONPATH)"
fi
rm -rf /tmp/vx
add_extra
out=$(cd /tmp && PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" VLLM_USE_FLASHINFER_SAMPLER=0 \
  timeout 300 python3 -P -c "import vllm; print('vllm', vllm.__version__, 'from', vllm.__file__)" 2>&1)
last=$(echo "$out" | tail -1)
case "$last" in
  vllm\ *) echo "$last" >"$site/.done"; echo "vllm-setup: $last" ;;
  *) echo "vllm-setup: vLLM does not import from $site:"; echo "$out" | tail -15; exit 1 ;;
esac
