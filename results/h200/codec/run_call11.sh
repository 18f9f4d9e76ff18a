#!/bin/bash
# Device call 11 (repo root): the codec on the H200, eager, compiled (torch.compile) and triton (two hand-fused
# kernels). Expected ~100 s.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
mkdir -p /tmp/pp && ln -sfn $PWD /tmp/pp/patchray
export PYTHONPATH=/tmp/pp:/tmp/site PYTHONUNBUFFERED=1 PATCHRAY_SPAWN_BACKEND=gloo
R=/tmp/r11; mkdir -p $R
pack() { tar czf "$OUT/call11.tgz.tmp" -C $R . && mv "$OUT/call11.tgz.tmp" "$OUT/call11.tgz"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $R/machine.txt 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> $R/machine.txt 2>&1
timeout 200 python3 -m patchray.distributed.bench.codec_bench --device cuda --numel 16777216 134217728 \
  --iters 5 --codecs eager compiled triton --out $R/codec.json > $R/codec.log 2>&1; echo codec rc $?; pack
cat $R/machine.txt
python3 -c "
import json; d=json.load(open('$R/codec.json'))
for r in d['rows']: print({k: r.get(k) for k in ('numel','bits','codec','encode_ms_per_gb','apply_ms_per_gb','receiver_equals_sender','error')})"
timeout 60 python3 -c "
import torch; from patchray.distributed.sampling.comm_manager import codec_kinds; print('codec_kinds', codec_kinds(torch.device('cuda'), (4, 2)))" 2>&1 | tail -2
