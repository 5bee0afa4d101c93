"""Operations: metrics, logs, `kvbroker status`, the health probe, memory trimming after big requests."""
