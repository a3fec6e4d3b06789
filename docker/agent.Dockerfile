# syntax=docker/dockerfile:1
# kernelctl node agent image: `kernelctl agent` on GPU nodes, on a CUDA PyTorch base image.
#
# Build from the repository root (docs/deploy.md):
#   docker build -f docker/agent.Dockerfile \
#     --build-arg BASE_IMAGE=<a CUDA PyTorch runtime image, e.g. pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime
#                             or an NGC PyTorch release from your registry mirror> \
#     -t REGISTRY/kernelctl-agent:0.1.0 .
#
# The base image provides torch + CUDA; the project is installed with that torch pinned, so pip never
# replaces it. Triton compiles a small launcher with the system C compiler at run time, so gcc is
# installed. The GPUs come from the NVIDIA container runtime (NVIDIA_VISIBLE_DEVICES), not from this image.

ARG BASE_IMAGE=pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}
ARG PIP_EXTRA_INDEX_URL=""
ARG PIP_INDEX_URL=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive
USER root
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kernelctl/ kernelctl/
COPY kernelpack/ kernelpack/
COPY controller/ controller/
COPY agents/ agents/
COPY cli/ cli/
COPY sim/ sim/
COPY migrations/ migrations/
RUN python -c "import torch; print('torch==' + torch.__version__)" > /tmp/torch-constraint.txt \
 && python -m pip install --constraint /tmp/torch-constraint.txt . \
 && rm -rf /src /tmp/torch-constraint.txt \
 && kernelctl --help >/dev/null
RUN (getent group 10001 || groupadd --system --gid 10001 kernelctl) \
 && useradd --system --uid 10001 --gid 10001 --home-dir /home/kernelctl --create-home --shell /usr/sbin/nologin kernelctl \
 && mkdir -p /var/cache/kernelctl /var/run/kernelctl /var/lib/kernelctl \
 && chown 10001:10001 /var/cache/kernelctl /var/run/kernelctl /var/lib/kernelctl
LABEL org.opencontainers.image.title="kernelctl-agent" \
      org.opencontainers.image.description="kernelctl node agent: trials and canary switching of GPU kernel bundles" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    KERNELCTL_AGENT_METRICS_PORT=9400 \
    KERNELCTL_CACHE_DIR=/var/cache/kernelctl \
    KERNELCTL_RUNTIME_DIR=/var/run/kernelctl \
    KERNELCTL_DATA_DIR=/var/lib/kernelctl \
    TRITON_CACHE_DIR=/var/cache/kernelctl/triton
USER 10001:10001
WORKDIR /home/kernelctl
EXPOSE 9400
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/metrics' % os.environ.get('KERNELCTL_AGENT_METRICS_PORT', '9400'), timeout=4)"]
ENTRYPOINT ["kernelctl"]
CMD ["agent"]
