"""The HTTP core shared by every HTTP front door.

Requests and headers, the policy, problem answers, and ASGI and WSGI I/O.
"""
