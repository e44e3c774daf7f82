set -u
export PYTHONUNBUFFERED=1 LORA_SUITE_GIT_COMMIT=$1
R=$OUT/runs; mkdir -p $R
timeout 250 python3 -m lora_suite extended --report-dir $R > $OUT/extended.log 2>&1; echo "extended exit $?" >> $OUT/summary.txt
timeout 250 python3 -m lora_suite selftest-gpu --report-dir $R -- -k "growing_with_the_models_own_state" > $OUT/selftest.log 2>&1; echo "selftest growing exit $?" >> $OUT/summary.txt
for f in $R/*/report.json; do python3 -c "
import json,sys; r=json.load(open('$f')); s=r['summary']; print(r['run_id'], r['selection'], r['implementation']['name'], s, [(c['name'][:70], c['value'], c['threshold']) for c in r['checks'] if 'aged' in c['name'] or not c['passed']][:6])" >> $OUT/summary.txt 2>&1; done
tar czf $OUT/runs.tgz -C $R .
