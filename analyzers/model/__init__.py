"""The model family: parameter use, mode switches, step-time stability and its causes."""
