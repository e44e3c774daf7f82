set -u
export PYTHONUNBUFFERED=1 LORA_SUITE_GIT_COMMIT=$1
export PYTHONPATH=$PWD/.whl/site:$PWD/examples
S=$OUT/sc; mkdir -p $S
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> $OUT/summary.txt
python3 -c "import torch,cupy,transformers,peft;print(torch.__version__,cupy.__version__,transformers.__version__,peft.__version__)" >> $OUT/summary.txt 2>&1
timeout 560 python3 -m lora_suite scorecard --lora-impl peft,peft-bnb,axolotl,peft-liger,plain_lora:make --jobs 5 --no-bench --report-dir $S > $OUT/scorecard.log 2>&1; echo "scorecard exit $?" >> $OUT/summary.txt
for f in $S/*/report.json; do python3 -c "
import json,sys; r=json.load(open('$f')); s=r['summary']; print(r['run_id'], r['selection'], r['implementation']['name'], s, len(r['checks']), len(r.get('not_applicable',[])), [c['name'][:90] for c in r['checks'] if not c['passed']][:6])" >> $OUT/summary.txt 2>&1; done
cp $S/scorecard.md $OUT/ 2>/dev/null
tar czf $OUT/sc.tgz -C $S .
