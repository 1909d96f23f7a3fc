# attnlab app image: serves the Streamlit app on 0.0.0.0:8501 inside the container.
#   docker build -t attnlab . && docker run --rm -p 127.0.0.1:8501:8501 attnlab
# Same steps as the README's first command (scripts/install.sh, scripts/app.sh).
FROM python:3.11-slim-bookworm

# Chromium for figure export (PNG/SVG/PDF through kaleido); g++ for attnlab's CPU kernels, built on
# first use on the machine that runs them (-march=native); curl for the health check.
# Not version-pinned: Debian's security updates replace chromium's version within a release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends chromium curl g++ \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
# torch first, CPU build: otherwise pip resolves a multi-GB CUDA build.
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0"
COPY requirements.txt ./
RUN pip install --no-cache-dir -r requirements.txt
COPY pyproject.toml README.md ./
COPY attnlab ./attnlab
COPY app ./app
COPY .streamlit ./.streamlit
COPY checkpoints ./checkpoints
RUN pip install --no-cache-dir --no-deps -e .

RUN useradd --create-home --uid 1000 attnlab && chown -R attnlab /app
# Numeric, so that Kubernetes' runAsNonRoot can verify it.
USER 1000
ENV HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
EXPOSE 8501
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["sh", "-c", "curl --fail --silent http://127.0.0.1:8501/_stcore/health || exit 1"]
CMD ["python", "app/serve.py", \
     "--server.address", "0.0.0.0", "--server.port", "8501", \
     "--server.headless", "true", "--browser.gatherUsageStats", "false"]
