# CUDA 13 image with the GPU stack the benchmark was tested with (requirements.txt) and the benchmark.
#   docker build -t dlrmv4 .
#   docker run --gpus all --ipc=host -v /data:/data dlrmv4 ./download_dataset.sh --size 5b --data-path /data
#   docker run --gpus all --ipc=host -v /data:/data dlrmv4 ./run_and_time.sh --preset yambda-5b --data-path /data
FROM nvidia/cuda:13.0.2-cudnn-devel-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.12 python3.12-venv python3-pip git ca-certificates \
 && rm -rf /var/lib/apt/lists/*
RUN python3.12 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH VIRTUAL_ENV=/opt/venv

WORKDIR /workspace/dlrmv4
COPY requirements.txt requirements-nodeps.txt ./
RUN pip install --upgrade pip && pip install -r requirements.txt && pip install --no-deps -r requirements-nodeps.txt
COPY . .
RUN pip install --no-deps -e recommendation_v4
# The scripts use this interpreter as it is instead of creating .venv.
ENV DLRMV4_NO_VENV=1
CMD ["./run_and_time.sh"]
