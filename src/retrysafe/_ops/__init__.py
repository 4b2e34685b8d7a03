"""Operations: admin API, monitor, watch, sweeps, servers and the dashboard's assets."""
