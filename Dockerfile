# syntax=docker/dockerfile:1
#
# Tandem on CUDA: one image for the router, prefill and decode workers (`tandem <command>`).
#
#   docker build -t tandem:local .
#   docker run --rm --gpus all -v "$PWD/models:/models:ro" tandem:local generate \
#       --model /models/Llama-3.2-1B-Instruct --device cuda --prompt "Hello"
#
# The versions match the GPU machines the project tests on: CUDA 13.0 (host driver >= 580),
# torch 2.11 built for CUDA 13.0, cupy-cuda13x (the `gpu` extra), Python 3.12 (Ubuntu 24.04).
# Model weights are never baked in: mount a checkpoint directory read-only at /models.

ARG CUDA_IMAGE=nvidia/cuda:13.0.2-runtime-ubuntu24.04

# ---- build: a virtual environment with CUDA torch and the project -----------------------------
FROM ${CUDA_IMAGE} AS build

ARG TORCH_VERSION=2.11.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PATH=/opt/tandem/bin:$PATH

RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*

RUN python3 -m venv /opt/tandem \
 && pip install --upgrade pip

# torch alone first, from the PyTorch index of this CUDA version: the project then finds
# `torch>=2.11` satisfied and pip never swaps in another build. Its own layer, so editing the
# project does not download it again.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

WORKDIR /src
COPY . .
# Not editable: the final stage takes /opt/tandem alone, without the source tree.
# The smoke test imports every service module (`tandem --help` builds all their parsers); no
# GPU is needed to import torch, triton or cupy.
# xgrammar (structured outputs) is a dependency: it keeps this torch.
# `nixl`: the nixl transport between hosts (deploy/k8s uses it); `import nixl` picks the CUDA 13
# build that matches this torch.
RUN pip install ".[gpu,nixl]" \
 && python -c "import torch, cupy, xgrammar, nixl._api; print('torch', torch.__version__, 'cuda', torch.version.cuda)" \
 && tandem --help > /dev/null

# ---- runtime ------------------------------------------------------------------------------------
FROM ${CUDA_IMAGE}

# gcc, libc6-dev and python3-dev: Triton compiles a small C launcher for its kernels the first
# time it runs them, with the C compiler and Python's headers (no compiler: "Failed to find C
# compiler"). ca-certificates: the OTLP exporter and hub downloads where a network exists.
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
        python3 python3-dev gcc libc6-dev ca-certificates \
 && rm -rf /var/lib/apt/lists/*

# A fixed, non-root user. Not 1000: Ubuntu 24.04 images already have `ubuntu` with that id.
ARG TANDEM_UID=10001
# /certs: the cluster's TLS files (docker-compose.yml's certs service writes them);
# /kernel-cache: Triton's compiled kernels (TRITON_CACHE_DIR in compose). A fresh named volume
# takes its directory's owner, so the services can write there.
RUN useradd --create-home --uid "${TANDEM_UID}" --user-group --shell /usr/sbin/nologin tandem \
 && mkdir -p /models /certs /kernel-cache \
 && chown tandem:tandem /models /certs /kernel-cache \
 && chmod 700 /certs

COPY --from=build /opt/tandem /opt/tandem

# CUDA_DEVICE_ORDER: cuda:N counts the GPUs given to the container in PCI bus order, as
# nvidia-smi and docker-compose.yml's device_ids do (CUDA's default puts the fastest first).
# The caches (compiled Triton kernels, the demo checkpoint) live in the user's home.
ENV PATH=/opt/tandem/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    CUDA_DEVICE_ORDER=PCI_BUS_ID \
    TRITON_CACHE_DIR=/home/tandem/.cache/triton \
    TANDEM_CACHE_DIR=/home/tandem/.cache/tandem

USER tandem
WORKDIR /home/tandem

# Checkpoint directories (config.json, *.safetensors, tokenizer files); mount it read-only.
VOLUME ["/models"]

# Router: gRPC 50051, HTTP 8000 (with /metrics). Workers as docker-compose.yml runs them:
# prefill 50061, decode 50062, their metrics 9101 and 9102. Documentation only; nothing listens
# until a command says so.
EXPOSE 50051 8000 50061 50062 9101 9102

ENTRYPOINT ["tandem"]
CMD ["--help"]
