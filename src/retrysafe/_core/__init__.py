"""The engine and what runs beside it.

Heartbeats, transactions, compare-and-set cells, the deployment secret,
principals and metrics reporting.
"""
