from exporters.export import export
