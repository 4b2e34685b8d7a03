"""MCP servers that the MCP door's tests run in processes of their own."""
