#!/bin/bash
# Download vLLM 0.24.0 and the wheels the H200 image lacks (versions that import together there:
# ../shared/PEERS.md), tar them and split the tar into 50 MB parts (the tracked tree, about 14 MB, travels beside each), carried to the device over
# back-to-back runs in .vv/ (benchmarks/vllm_setup.sh joins and installs them there).
# Run where a package registry is reachable: bash benchmarks/vllm_download.sh DIR  -> DIR/vp00..vpNN, DIR/vp.sum
set -eu
dir=${1:?usage: bash benchmarks/vllm_download.sh DIR}
mkdir -p "$dir/w/small" && cd "$dir/w"
plat="--no-deps --python-version 3.12 --only-binary=:all:"
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_31_x86_64 manylinux2014_x86_64 manylinux_2_17_x86_64; do
  plat="$plat --platform $p"
done
python3 -m pip download -q $plat vllm==0.24.0 -d .
failed=""
# pinned where a newer release does not import with vLLM 0.24 on the device (PEERS.md); the
# HTTP client stack (httpx ...) too, for an image that lacks it (the online peer needs it); vllm
# serve imports model-hosting-container-standards (and its jmespath, supervisor), LLM does not;
# its fp8 quantization (--quantization fp8) imports loguru (no dependencies on Linux)
for p in flashinfer-python==0.6.12 apache-tvm-ffi==0.1.9 openai==2.54.0 fastapi==0.136.3 xgrammar==0.2.1 \
  llguidance==1.7.6 compressed-tensors==0.17.0 depyf==0.20.0 lark==1.2.2 diskcache==5.6.3 \
  outlines_core==0.2.14 lm-format-enforcer==0.11.3 \
  pydantic pydantic-core msgspec pyzmq blake3 cachetools gguf partial-json-parser mistral_common \
  prometheus-fastapi-instrumentator pybase64 cbor2 ijson setproctitle openai-harmony watchfiles \
  python-json-logger nvidia-cudnn-frontend starlette annotated-types typing-inspection jiter distro \
  sniffio jsonschema jsonschema-specifications referencing rpds-py interegular pycountry uvicorn \
  httpx httpcore h11 anyio certifi idna model-hosting-container-standards jmespath supervisor \
  loguru; do
  python3 -m pip download -q $plat "$p" -d small || { echo "FAILED $p"; failed="$failed $p"; }
done
ls vllm-0.24.0-*.whl >/dev/null
tar cf ../vall.tar vllm-0.24.0-*.whl small
cd .. && rm -rf w && split -b 50000000 -d vall.tar vp
# how many parts make the tar, and its checksum (vllm_setup.sh checks both)
echo "$(ls vp[0-9]* | wc -l) $(md5sum <vall.tar | cut -d' ' -f1)" >vp.sum && rm vall.tar
ls -l vp* && cat vp.sum
[ -z "$failed" ] || { echo "download failed for:$failed"; exit 1; }
