set -x
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv
for s in int8 int4; do
python3 benchmarks/decode.py --no-baselines --check --shapes 32x32768,128x4096,1x131072 --schemes $s --variants default,w2s2a,w4s2a,w4s2at,w4s2atf --json $OUT/pt_$s.json 2>&1 | grep -v Warning | tail -40
done
