"""matrixinfer.ems"""
