"""The model families, one package each.

glm4v/   GLM-4.1V and GLM-4.5V
"""
