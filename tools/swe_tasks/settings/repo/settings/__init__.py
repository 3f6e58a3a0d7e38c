from settings.load import SettingsError, load_settings
