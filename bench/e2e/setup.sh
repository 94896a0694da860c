# Sourced by run.sh and profile.sh: the environment of an end-to-end run on the GPU machine, from the repository root.
# transformers 4.5x for trust_remote_code (the published DeepSeek files fail to import on 5.x), libcst for the CLI and
# peft for LORA_RANK are installed from the wheels in .whl/ or .whl/base/ (.whl/tf4) into /tmp/site; NVLink
# multicast stays off (device notes).
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
# without .whl/tf4 the device's own transformers runs the rewritten stand-in (its compat rewrites cover 5.x)
python3 -m pip install -q --no-index --no-deps --target /tmp/site $(ls .whl/{,base/}{libcst,peft}-*.whl .whl/tf4/*.whl 2>/dev/null)
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_MODULES_CACHE=/tmp/e2e/modules
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NPROC=${NPROC:-$(python3 -c "import torch; print(torch.cuda.device_count())")}
rm -rf /tmp/e2e && mkdir -p /tmp/e2e
