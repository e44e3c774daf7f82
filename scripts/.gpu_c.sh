set -u
export PYTHONUNBUFFERED=1 LORA_SUITE_GIT_COMMIT=$(git rev-parse HEAD 2>/dev/null || echo unknown)
export PYTHONPATH=$PWD/.whl/site
R=$OUT/runs; mkdir -p $R
python3 -m pip install -q --no-deps --target /tmp/suite2 dist/*.whl >/dev/null 2>&1; mkdir -p /tmp/user && cp examples/plain_lora.py /tmp/user/
ex() { ( cd /tmp/user && PYTHONPATH=/tmp/suite2:/tmp/user:$PYTHONPATH timeout 250 python3 -m lora_suite $1 --lora-impl plain_lora:make --report-dir $R > $OUT/example-$1.log 2>&1; echo "example $1 exit $?" >> $OUT/summary.txt ) }
timeout 150 python3 -m lora_suite quick --report-dir $R > $OUT/cupy-quick.log 2>&1; echo "cupy quick exit $?" >> $OUT/summary.txt
ex convergence & ex memory & wait
for impl in axolotl peft-bnb; do timeout 200 python3 -m lora_suite quick --lora-impl $impl --report-dir $R > $OUT/$impl-quick.log 2>&1 & done
timeout 200 python3 -m lora_suite memory --lora-impl axolotl --report-dir $R > $OUT/axolotl-memory.log 2>&1; wait
timeout 200 python3 -m lora_suite memory --lora-impl peft-liger --report-dir $R > $OUT/liger-memory.log 2>&1
for f in $R/*/report.json; do python3 -c "
import json,sys; r=json.load(open('$f')); s=r['summary']; print(r['run_id'], r['selection'], r['implementation']['name'], s, [c['name'][:90] for c in r['checks'] if not c['passed']][:6])" >> $OUT/summary.txt; done
tar czf $OUT/runs.tgz -C $R .
