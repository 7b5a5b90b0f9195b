# Minimal for now: the deployment issue makes this multi-stage with a non-root user,
# a CUDA build argument, the model volume and a health check.
FROM python:3.11-slim
WORKDIR /app
COPY . .
RUN ./scripts/install.sh
CMD ["make", "run"]
