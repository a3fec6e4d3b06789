# syntax=docker/dockerfile:1
# kernelctl controller image: `kernelctl serve` and `kernelctl db upgrade` (the chart's migrations hook).
#
# Build from the repository root (docs/deploy.md):
#   docker build -f docker/controller.Dockerfile \
#     --build-arg PIP_EXTRA_INDEX_URL=<your CPU-only PyTorch wheel index> \
#     --build-arg TORCH_SPEC="torch==2.13.0+cpu" \
#     -t REGISTRY/kernelctl-controller:0.1.0 .
#
# The controller imports no GPU code, but the distribution depends on torch (kernelpack shares the
# bundle format). Installing TORCH_SPEC first, from a CPU wheel index, keeps CUDA libraries (several GB)
# out of the image; `pip install .` then finds torch satisfied. The builder chooses the index: this file
# names no package host. pip reads PIP_EXTRA_INDEX_URL / PIP_INDEX_URL from the build args.

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_SPEC=torch
ARG PIP_EXTRA_INDEX_URL=""
ARG PIP_INDEX_URL=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/kernelctl
ENV PATH=/opt/kernelctl/bin:$PATH
# torch first and alone: the CPU build, from the index the builder named
RUN pip install "${TORCH_SPEC}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kernelctl/ kernelctl/
COPY kernelpack/ kernelpack/
COPY controller/ controller/
COPY agents/ agents/
COPY cli/ cli/
COPY sim/ sim/
COPY migrations/ migrations/
# pin the torch just installed so resolving the project can never swap it for a CUDA build
RUN python -c "import torch; print('torch==' + torch.__version__)" > /tmp/torch-constraint.txt \
 && pip install --constraint /tmp/torch-constraint.txt . \
 && kernelctl --help >/dev/null

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="kernelctl-controller" \
      org.opencontainers.image.description="kernelctl controller: canary rollouts of GPU kernel bundles" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 kernelctl \
 && useradd --system --uid 10001 --gid 10001 --home-dir /home/kernelctl --create-home --shell /usr/sbin/nologin kernelctl
COPY --from=build /opt/kernelctl /opt/kernelctl
ENV PATH=/opt/kernelctl/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    KERNELCTL_LISTEN_HOST=0.0.0.0 \
    KERNELCTL_LISTEN_PORT=8080
USER 10001:10001
WORKDIR /home/kernelctl
EXPOSE 8080
HEALTHCHECK --interval=15s --timeout=3s --start-period=20s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('KERNELCTL_LISTEN_PORT', '8080'), timeout=2)"]
ENTRYPOINT ["kernelctl"]
CMD ["serve"]
