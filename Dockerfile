# credproxy as a sidecar egress proxy. See docs/deployment.md.
#
# The Python minor version must be the one CI tests on: pip then resolves the same mitmproxy
# release the suite passed with (11.0.x on 3.11; 12.x needs 3.12). tests/test_compose.py checks.
#
# Pin the base by digest where you build: `docker pull python:3.11.11-slim-bookworm`, then
# `docker inspect --format '{{index .RepoDigests 0}}' python:3.11.11-slim-bookworm`, and write
# FROM python:3.11.11-slim-bookworm@sha256:<that digest>. The machines this repository is built
# on cannot pull images, so no digest is written here: one that could not be checked would be
# a guess (docs/deployment.md).
FROM python:3.11.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Every dependency, with the aws, vault and otel extras (secret references held in AWS or Vault,
# the OTLP export), and setuptools to build credproxy itself, from requirements.lock: pinned,
# each file checked against its hashes. credproxy then installs from the copied source alone,
# with nothing more fetched. tests/test_compose.py checks the lock against pyproject.toml.
COPY requirements.lock pyproject.toml README.md /tmp/src/
COPY addon /tmp/src/addon
COPY store /tmp/src/store
RUN pip install --no-cache-dir --require-hashes -r /tmp/src/requirements.lock \
    && pip install --no-cache-dir --no-deps --no-build-isolation --no-index /tmp/src \
    && rm -rf /tmp/src

# /var/lib/credproxy holds the store, the key file and certs/; /ca receives only the public CA
# certificate for the sandboxes. Named volumes copy this ownership when they are first mounted.
RUN useradd --system --user-group --uid 10001 --home-dir /var/lib/credproxy \
        --shell /usr/sbin/nologin credproxy \
    && install -d -o credproxy -g credproxy -m 0700 /var/lib/credproxy /var/lib/credproxy/certs \
    && install -d -o credproxy -g credproxy -m 0755 /ca

USER credproxy
WORKDIR /var/lib/credproxy

EXPOSE 8080

# python:3.11-slim has no curl. http.client ignores *_PROXY variables, unlike urllib.
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import http.client as h; c = h.HTTPConnection('127.0.0.1', 9090, timeout=3); c.request('GET', '/readyz'); raise SystemExit(c.getresponse().status != 200)"]

# init is idempotent: it creates the store, key and CA on the first start and migrates later.
CMD ["sh", "-c", "credproxy init && exec credproxy run --listen 0.0.0.0:8080 --admin 127.0.0.1:9090"]
