"""Operations: metrics (replica and cluster-wide) and health probes."""
