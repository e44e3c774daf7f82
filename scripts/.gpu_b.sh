set -u
export PYTHONUNBUFFERED=1 LORA_SUITE_GIT_COMMIT=$(git rev-parse HEAD 2>/dev/null || echo unknown)
export PYTHONPATH=$PWD/.whl/site
R=$OUT/runs; mkdir -p $R
timeout 150 python3 -m lora_suite quick --report-dir $R > $OUT/cupy-quick.log 2>&1; echo "cupy quick exit $?" >> $OUT/summary.txt
for impl in axolotl peft-bnb; do timeout 200 python3 -m lora_suite quick --lora-impl $impl --report-dir $R > $OUT/$impl-quick.log 2>&1 & done; wait
timeout 380 python3 -m lora_suite selftest-gpu --report-dir $R -- -k example -s > $OUT/plants.log 2>&1; echo "plants exit $?" >> $OUT/summary.txt
for f in $R/*/report.json; do python3 -c "
import json,sys; r=json.load(open('$f')); s=r['summary']; print(r['run_id'], r['implementation']['name'], s, [c['name'][:90] for c in r['checks'] if not c['passed']][:6])" >> $OUT/summary.txt; done
cp $OUT/summary.txt $OUT/summary-copy.txt 2>/dev/null
tar czf $OUT/runs.tgz -C $R .
