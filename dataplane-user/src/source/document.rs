//! A parsed YAML or JSON document as the decoders read it: a field's text, and the whole
//! document decoded into a type, with the error as text.

/// An object before its kind is known: a manifest's YAML document, or a watched object's JSON
/// (decoded straight into its type: through a YAML value it cost the API source most of a
/// large cluster's first sync).
pub trait Document: Sized {
    /// The string at `path` (`["metadata", "name"]`), if there is one.
    fn text(&self, path: &[&str]) -> Option<&str>;
    /// The object as `T`, or why not (naming the field where the format can).
    fn decode<T: serde::de::DeserializeOwned>(self) -> Result<T, String>;
}

impl Document for serde_yaml::Value {
    fn text(&self, path: &[&str]) -> Option<&str> {
        path.iter()
            .try_fold(self, |value, key| value.get(key))?
            .as_str()
    }

    fn decode<T: serde::de::DeserializeOwned>(self) -> Result<T, String> {
        serde_yaml::from_value(self).map_err(|e| e.to_string())
    }
}

impl Document for serde_json::Value {
    fn text(&self, path: &[&str]) -> Option<&str> {
        path.iter()
            .try_fold(self, |value, key| value.get(key))?
            .as_str()
    }

    fn decode<T: serde::de::DeserializeOwned>(self) -> Result<T, String> {
        serde_json::from_value(self).map_err(|e| e.to_string())
    }
}
