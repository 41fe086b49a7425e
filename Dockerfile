# The image the Helm chart runs by default (deploy/helm/cleave, `image.repository`/`image.tag`):
# CUDA, PyTorch, Ray (the version the chart's `rayVersion` names) and Cleave.
#   docker build -t ghcr.io/cleave-llm/cleave:0.1.0 .
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

# torch as the Makefile pins it (PyPI's Linux wheel is the CUDA build); ray as the chart's rayVersion
ARG TORCH_VERSION=2.13.0
ARG RAY_VERSION=2.60.0

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    VIRTUAL_ENV=/opt/cleave \
    PATH=/opt/cleave/bin:$PATH

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev \
       build-essential wget ca-certificates libibverbs1 librdmacm1 ibverbs-providers \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv $VIRTUAL_ENV \
    && pip install --upgrade pip

# Dependencies first, so a source change does not reinstall torch.
RUN pip install "torch==${TORCH_VERSION}" "ray[serve]==${RAY_VERSION}" huggingface_hub
WORKDIR /opt/cleave-src
COPY pyproject.toml README.md ./
COPY cluster ./cluster
COPY router ./router
COPY workers ./workers
COPY kvtransfer ./kvtransfer
RUN pip install . && python -c "import cluster.app, router, workers, kvtransfer"

# KubeRay starts Ray in this container with `ray start`; the Serve application is
# `cluster.app:build_app` (serveConfigV2). Run as a non-root user.
RUN useradd --create-home --uid 1000 ray
USER 1000
WORKDIR /home/ray
