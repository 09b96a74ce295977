"""tailguard.tools.doctor"""
