# kvshard_component(<name> [DEPS <component>...] [EXTERNAL <target_link_libraries args>...])
#
# Adds the static library kvshard_<name> from src/<name>/*.cpp (not mpi_backend.cpp /
# mpi_missing.cpp, vllm_zmq_subscriber.cpp / vllm_zmq_missing.cpp, router_http.cpp /
# router_http_missing.cpp: the top level picks one of each pair). DEPS are components; each must stand to the left of
# <name> in KVSHARD_COMPONENT_ORDER (the arrows of GUIDE.md), or configuring fails. The target's
# include path is a staged tree (build/kvshard_components/<name>/) holding links to its own
# include/kvshard/<name> and src/<name> only; the DEPS bring theirs. So `#include
# "kvshard/<right>/..."` from a component finds no such file.
set(KVSHARD_COMPONENT_ORDER common model layout cache attention comm exec transfer serve router
                            planner sim)
set(KVSHARD_COMPONENT_TARGETS "")

function(kvshard_component name)
  cmake_parse_arguments(KC "" "" "DEPS;EXTERNAL" ${ARGN})
  list(FIND KVSHARD_COMPONENT_ORDER ${name} self_index)
  if(self_index LESS 0)
    message(FATAL_ERROR "kvshard_component(${name}): not in KVSHARD_COMPONENT_ORDER")
  endif()
  foreach(dep ${KC_DEPS})
    list(FIND KVSHARD_COMPONENT_ORDER ${dep} dep_index)
    if(dep_index LESS 0 OR NOT dep_index LESS self_index)
      message(FATAL_ERROR "kvshard_component(${name}): '${dep}' is not to the left of '${name}' in "
                          "${KVSHARD_COMPONENT_ORDER}: an arrow may only point left (GUIDE.md)")
    endif()
  endforeach()

  set(stage ${CMAKE_BINARY_DIR}/kvshard_components/${name})
  file(MAKE_DIRECTORY ${stage}/include/kvshard ${stage}/src)
  if(EXISTS ${PROJECT_SOURCE_DIR}/include/kvshard/${name} AND NOT EXISTS ${stage}/include/kvshard/${name})
    file(CREATE_LINK ${PROJECT_SOURCE_DIR}/include/kvshard/${name} ${stage}/include/kvshard/${name} SYMBOLIC)
  endif()
  if(NOT EXISTS ${stage}/src/${name})
    file(CREATE_LINK ${PROJECT_SOURCE_DIR}/src/${name} ${stage}/src/${name} SYMBOLIC)
  endif()

  file(GLOB sources CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/src/${name}/*.cpp)
  list(FILTER sources EXCLUDE REGEX "/(mpi_(backend|missing)|vllm_zmq_(subscriber|missing)|router_http(_missing)?)\\.cpp$")
  add_library(kvshard_${name} STATIC ${sources})
  add_library(kvshard::${name} ALIAS kvshard_${name})
  set_target_properties(kvshard_${name} PROPERTIES EXPORT_NAME ${name})
  target_include_directories(kvshard_${name} PUBLIC
    $<BUILD_INTERFACE:${stage}/include> $<BUILD_INTERFACE:${stage}/src>
    $<INSTALL_INTERFACE:include>)
  foreach(dep ${KC_DEPS})
    target_link_libraries(kvshard_${name} PUBLIC kvshard_${dep})
  endforeach()
  if(KC_EXTERNAL)
    target_link_libraries(kvshard_${name} ${KC_EXTERNAL})
  endif()
  set(KVSHARD_COMPONENT_TARGETS ${KVSHARD_COMPONENT_TARGETS} kvshard_${name} PARENT_SCOPE)
endfunction()
