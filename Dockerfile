# moetier's OpenAI- and Anthropic-compatible server on an NVIDIA GPU.
#   docker build -t moetier .
#   docker run --gpus all -p 8000:8000 -v moetier-cache:/cache -e MOETIER_API_KEY=... \
#     moetier Qwen/Qwen3-30B-A3B --convert-experts q2s --gpu-memory 24GiB --host-memory 64GiB
# The arguments after the image are `moetier serve`'s (docs/operations.md); none: the demo model.
# A Hub id is downloaded and converted once into the /cache volume, then served from there.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/moetier \
    PATH=/opt/moetier/bin:$PATH

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Python from the distribution; apt versions follow the base image (.hadolint.yaml)
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/moetier

# the package and its dependencies (torch's Linux wheels carry their CUDA libraries; triton for
# the GPU kernels), pinned by pyproject.toml's ranges
WORKDIR /src
COPY pyproject.toml README.md ./
COPY moetier ./moetier
RUN pip install ".[gpu]" \
    && rm -rf /src

# a user without root (uid 10001: Ubuntu images already have 1000); the cache volume is theirs
RUN groupadd --gid 10001 moetier \
    && useradd --create-home --uid 10001 --gid 10001 --shell /usr/sbin/nologin moetier \
    && mkdir -p /cache \
    && chown 10001:10001 /cache
ENV HF_HOME=/cache/huggingface \
    MOETIER_CACHE=/cache/moetier
VOLUME ["/cache"]
USER 10001:10001
WORKDIR /home/moetier

EXPOSE 8000
# /health answers 200 once the model is loaded (503 while it loads: a large model's first run
# downloads and converts it, hence the long start period)
HEALTHCHECK --interval=30s --timeout=5s --start-period=30m --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["moetier", "serve", "--host", "0.0.0.0", "--port", "8000"]
