"""Reports: the terminal summary (rich) and the self-contained HTML report (Jinja2)."""
