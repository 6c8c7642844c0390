"""The core layer: errors, options, plugins, the federation and its rows' schema, result rows and atomic writes."""
