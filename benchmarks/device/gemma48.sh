# Forty-eighth session: where the Gemma engine GPU tests spend their time (three sessions' calls
# ended them at 200-330 s with no test reported). Each sliding-window engine test alone, under
# pytest's faulthandler (every thread's stack at 150 s), Triton's cache kept under $OUT so that a
# later call can carry it (.triton-cache) and skip the compiles:
#     bash benchmarks/device/gemma48.sh           (carry .whl, and .triton-cache if present)
source benchmarks/device/setup.sh || exit 1
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$OUT/triton-cache
mkdir -p "$TRITON_CACHE_DIR"
[ -d .triton-cache ] && cp -r .triton-cache/. "$TRITON_CACHE_DIR"/
echo "started $(date +%T), cache entries: $(ls "$TRITON_CACHE_DIR" | wc -l)"
for arch in ${ARCHES:-mistral gemma3 gemma2}; do
  echo "== $arch $(date +%T)"
  timeout -s INT "${LIMIT:-170}" python3 -m pytest -q -rf -x -p no:warnings -p no:cacheprovider \
      --durations=3 -o faulthandler_timeout=150 tests/gpu/test_engine_gpu.py \
      -k "sliding and $arch" 2>&1 | grep -v "^  File .*site-packages/_pytest" | tail -60
done
echo "ended $(date +%T), cache entries: $(ls "$TRITON_CACHE_DIR" | wc -l), $(du -sh "$TRITON_CACHE_DIR" | cut -f1)"
