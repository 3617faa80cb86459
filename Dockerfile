# kvserve: the text-generation server. The checkpoint is not baked in: mount it at /checkpoints.
#   docker build -t kvserve .                                   (torch from the default index: CUDA wheels)
#   docker build -t kvserve:cpu --build-arg TORCH_INDEX=<PyTorch's CPU wheel index URL> .   (a smaller CPU image)
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app

# g++ builds the exact CPU kernels (model/kernels/csrc) on first use; without it the server runs
# torch's kernels and says so in its log
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

# torch first, from the chosen index, so the project install never swaps in another build
RUN pip install "torch==${TORCH_VERSION}" ${TORCH_INDEX:+--index-url "${TORCH_INDEX}"}
# README.md* : pyproject names it as the long description; the glob keeps the build working without it
COPY pyproject.toml README.md* ./
COPY model ./model
COPY server ./server
RUN pip install . && useradd --create-home kvserve
USER kvserve
# build the kernels now, for this image's CPU (a different CPU at run time builds its own at start-up)
RUN python -c "from model import kernels; print(kernels.unavailable_reason() or 'exact kernels built')"

EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
  CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4).status != 200)"]
ENTRYPOINT ["kvserve"]
CMD ["--checkpoint", "/checkpoints/shakespeare-small", "--host", "0.0.0.0", "--port", "8000", "--device", "auto"]
