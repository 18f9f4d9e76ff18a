#!/bin/bash
# Device call 10 (repo root): the compressed exchange's codec on the H200, eager and compiled (compiled=True:
# torch.compile's fused kernels, one compilation per code width). Expected ~120 s.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
mkdir -p /tmp/pp && ln -sfn $PWD /tmp/pp/patchray
export PYTHONPATH=/tmp/pp:/tmp/site PYTHONUNBUFFERED=1 PATCHRAY_SPAWN_BACKEND=gloo
R=/tmp/r10; mkdir -p $R
pack() { tar czf "$OUT/call10.tgz.tmp" -C $R . && mv "$OUT/call10.tgz.tmp" "$OUT/call10.tgz"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $R/machine.txt 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> $R/machine.txt 2>&1
timeout 300 python3 -m patchray.distributed.bench.codec_bench --device cuda --numel 1048576 16777216 134217728 \
  --iters 5 --compiled --out $R/codec.json > $R/codec.log 2>&1; echo codec rc $?; pack
cat $R/machine.txt
python3 -c "
import json; d=json.load(open('$R/codec.json'))
for r in d['rows']: print({k: r.get(k) for k in ('numel','bits','compiled','encode_ms_per_gb','apply_ms_per_gb','receiver_equals_sender','error')})"
python3 -c "
import torch; from patchray.distributed.sampling.comm_manager import codec_compiles; print('codec_compiles', codec_compiles(torch.device('cuda')))"
