# First call on a lent GPU machine (carry .whl and .gpu1): the wheels into /tmp/site, the MiniLM layers stashed for the
# next call (a call carries at most 64 MiB; docs/EXPORT.md, "Running the GPU checks")
set -o pipefail
mkdir -p /tmp/stash && cp .gpu1/model.safetensors /tmp/stash/ && cp -r .whl/site /tmp/whlsite && echo stashed
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
nvidia-smi -L; nproc
PYTHONPATH=/tmp/site python3 -c "import torch; print(torch.__version__, torch.cuda.is_available())"
