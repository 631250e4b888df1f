//! An object as the watchers receive it, untyped: its metadata decoded and the rest of its
//! JSON kept verbatim (without `last-applied-configuration`), so that one object that does not
//! decode as its kind is refused alone, not its whole list.

use std::{borrow::Cow, fmt};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::{Resource, api::ApiResource, core::DynamicResourceScope};
use serde::de::{self, Deserialize, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde_json::Value;

/// A watched object as the agent takes it from the watcher: the metadata the watcher reads
/// (name, namespace, resource version) and the object as JSON text, written out again as it
/// is read, without a tree of it, and later decoded from that text straight into its type.
/// Through a `serde_json::Value` tree first, decoding was most of a large cluster's first
/// sync (at 150,000 small pods, 2 s against 0.5 s); kube's `DynamicObject` buffers each object
/// twice for its flattened fields. Written out rather than kept as the server's raw text:
/// serde buffers a watch event whose `object` comes before its `type`, and a raw value cannot
/// be taken from a buffer. The field managers' bookkeeping and kubectl's copy of the last
/// applied object are dropped as they are read: nothing here reads them and they are often
/// most of an object.
#[derive(Clone, Debug, Default)]
pub struct WatchedObject {
    pub metadata: ObjectMeta,
    pub json: String,
}

/// kubectl's copy of the object as last applied (`kubectl apply`).
pub(super) const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";

impl<'de> Deserialize<'de> for WatchedObject {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(ObjectVisitor)
    }
}

struct ObjectVisitor;

impl<'de> Visitor<'de> for ObjectVisitor {
    type Value = WatchedObject;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a Kubernetes object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<WatchedObject, A::Error> {
        // Most objects fit: grown by doubling from nothing, the text was copied seven times.
        let mut text = Vec::with_capacity(1024);
        let mut json = JsonObject::begin(&mut text);
        let mut metadata = ObjectMeta::default();
        while let Some(key) = map.next_key::<String>()? {
            json.key(&key).map_err(de::Error::custom)?;
            if key == "metadata" {
                metadata = map.next_value_seed(MetadataSeed(json.text))?;
            } else {
                map.next_value_seed(Verbatim(json.text))?;
            }
        }
        json.end();
        let json = String::from_utf8(text).map_err(de::Error::custom)?;
        Ok(WatchedObject { metadata, json })
    }
}

/// A JSON object written out key by key at the end of `text`.
struct JsonObject<'a> {
    text: &'a mut Vec<u8>,
    empty: bool,
}

impl<'a> JsonObject<'a> {
    fn begin(text: &'a mut Vec<u8>) -> Self {
        text.push(b'{');
        Self { text, empty: true }
    }

    /// Writes `key` and the colon; its value follows.
    fn key(&mut self, key: &str) -> serde_json::Result<()> {
        if !std::mem::take(&mut self.empty) {
            self.text.push(b',');
        }
        serde_json::to_writer(&mut *self.text, key)?;
        self.text.push(b':');
        Ok(())
    }

    fn end(self) {
        self.text.push(b'}');
    }
}

/// Writes the value it is given to the text as JSON, whatever the deserializer.
struct Transcode<'a>(&'a mut Vec<u8>);

impl<'de> DeserializeSeed<'de> for Transcode<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        let mut writer = serde_json::Serializer::new(&mut *self.0);
        serde_transcode::transcode(deserializer, &mut writer).map_err(de::Error::custom)
    }
}

/// serde_json's name for its raw values (`serde_json::value::RawValue`, the `raw_value`
/// feature): asked for a newtype struct of this name, its deserializer hands over the value's
/// text as it is in the input, checked but not decoded.
const RAW_VALUE: &str = "$serde_json::private::RawValue";

/// Writes the value it is given to the text: straight from serde_json's input where it can
/// (the text as the server wrote it, found by a scan: a list's or an event's object comes to
/// the watchers so), else written out again as [`Transcode`] does (serde buffered it: an
/// event whose object comes before its type, or any other deserializer). Copying the text
/// rather than writing it again token by token was about half of the watchers' first pass
/// over 150,000 pods.
struct Verbatim<'a>(&'a mut Vec<u8>);

impl<'de> DeserializeSeed<'de> for Verbatim<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_newtype_struct(RAW_VALUE, self)
    }
}

impl<'de> Visitor<'de> for Verbatim<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }

    /// serde_json's raw value: one entry, its name the token and its value the text.
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        match map.next_key::<Key<'de>>()?.map(|key| key.0) {
            Some(key) if key == RAW_VALUE => map.next_value_seed(RawText(self.0)),
            // A deserializer that read a newtype struct as a map of its own (none known):
            // the map written out entry by entry.
            first => {
                let mut json = JsonObject::begin(self.0);
                let mut key = first;
                while let Some(name) = key {
                    json.key(&name).map_err(de::Error::custom)?;
                    map.next_value_seed(Transcode(json.text))?;
                    key = map.next_key::<Key<'de>>()?.map(|key| key.0);
                }
                json.end();
                Ok(())
            }
        }
    }

    fn visit_newtype_struct<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        Transcode(self.0).deserialize(deserializer)
    }
}

/// A map's key, borrowed from the input where it can be (serde's `Cow` always copies).
struct Key<'de>(Cow<'de, str>);

impl<'de> Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_str(KeyVisitor)
    }
}

struct KeyVisitor;

impl<'de> Visitor<'de> for KeyVisitor {
    type Value = Key<'de>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a key")
    }

    fn visit_borrowed_str<E: de::Error>(self, key: &'de str) -> Result<Key<'de>, E> {
        Ok(Key(Cow::Borrowed(key)))
    }

    fn visit_str<E: de::Error>(self, key: &str) -> Result<Key<'de>, E> {
        Ok(Key(Cow::Owned(key.to_owned())))
    }

    fn visit_string<E: de::Error>(self, key: String) -> Result<Key<'de>, E> {
        Ok(Key(Cow::Owned(key)))
    }
}

/// A raw value's text, appended as it is.
struct RawText<'a>(&'a mut Vec<u8>);

impl<'de> DeserializeSeed<'de> for RawText<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl Visitor<'_> for RawText<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a raw JSON value")
    }

    fn visit_str<E: de::Error>(self, text: &str) -> Result<(), E> {
        self.0.extend_from_slice(text.as_bytes());
        Ok(())
    }
}

/// Writes an object's metadata to the text without `managedFields` and the last applied
/// copy, and gives back its name, namespace and resource version.
struct MetadataSeed<'a>(&'a mut Vec<u8>);

impl<'de> DeserializeSeed<'de> for MetadataSeed<'_> {
    type Value = ObjectMeta;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<ObjectMeta, D::Error> {
        deserializer
            .deserialize_map(self)
            .map_err(|e: D::Error| de::Error::custom(format!("metadata: {e}")))
    }
}

impl<'de> Visitor<'de> for MetadataSeed<'_> {
    type Value = ObjectMeta;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an object's metadata")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<ObjectMeta, A::Error> {
        let mut json = JsonObject::begin(self.0);
        let mut metadata = ObjectMeta::default();
        while let Some(key) = map.next_key::<String>()? {
            if key == "managedFields" {
                map.next_value::<IgnoredAny>()?;
                continue;
            }
            json.key(&key).map_err(de::Error::custom)?;
            // Taken as any JSON value: a field of the wrong type is named when the object is
            // decoded into its type, for this object alone, and must not fail the whole list.
            let kept = match key.as_str() {
                "name" => &mut metadata.name,
                "namespace" => &mut metadata.namespace,
                "resourceVersion" => &mut metadata.resource_version,
                "annotations" => {
                    let mut annotations = map.next_value::<Value>()?;
                    if let Some(annotations) = annotations.as_object_mut() {
                        annotations.remove(LAST_APPLIED);
                    }
                    serde_json::to_writer(&mut *json.text, &annotations)
                        .map_err(de::Error::custom)?;
                    continue;
                }
                _ => {
                    map.next_value_seed(Verbatim(json.text))?;
                    continue;
                }
            };
            let value = map.next_value::<Value>()?;
            *kept = value.as_str().map(str::to_owned);
            serde_json::to_writer(&mut *json.text, &value).map_err(de::Error::custom)?;
        }
        json.end();
        Ok(metadata)
    }
}

impl Resource for WatchedObject {
    type DynamicType = ApiResource;
    type Scope = DynamicResourceScope;

    fn group(resource: &ApiResource) -> Cow<'_, str> {
        resource.group.as_str().into()
    }

    fn version(resource: &ApiResource) -> Cow<'_, str> {
        resource.version.as_str().into()
    }

    fn kind(resource: &ApiResource) -> Cow<'_, str> {
        resource.kind.as_str().into()
    }

    fn api_version(resource: &ApiResource) -> Cow<'_, str> {
        resource.api_version.as_str().into()
    }

    fn plural(resource: &ApiResource) -> Cow<'_, str> {
        resource.plural.as_str().into()
    }

    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}
