"""tailguard.tools.lab"""
